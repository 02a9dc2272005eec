"""Where the rows come from: the table's epoch plans of row ids, reads of rows by id (takes,
scans), the object store's options and errors, and the container limits the reads are sized by.
With data/streaming.py and data/reading.py, the only code that imports lancedb (plans, planning)."""
