"""`splitfeed local`: a whole job on one machine, sidecars and trainers as local processes, its
worlds changed the way the operator changes a cluster's."""
