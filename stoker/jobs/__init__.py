"""A training job's state: key and folder, lease, attempts, record store, stop requests, status."""
