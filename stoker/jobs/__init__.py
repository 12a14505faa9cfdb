"""A training job's state: its key and folder, lease, attempt log, record store, stop requests, status."""
