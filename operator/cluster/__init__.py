"""The operator's edges to the cluster: the Kopf handlers, the API calls, the webhooks, leader
election and metrics."""
