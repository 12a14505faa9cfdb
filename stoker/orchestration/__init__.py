"""Plain Python behind the Prefect tasks: how a training job is run and supervised, and how its
flow run ends on the Prefect server."""
