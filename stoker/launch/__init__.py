"""Launching training: job identity, local torchrun, docker, Kubernetes; exit codes and retries."""
