"""Training images: spec and content hash, build and push, wheelhouse, local base, GPU preflight."""
