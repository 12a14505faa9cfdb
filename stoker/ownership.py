"""How Stoker marks what it owns. The cost guard acts only on resources that carry these marks."""

# Docker container label set by the docker launcher (value "true").
DOCKER_OWNER_LABEL = "dev.stoker.owned"
# Further container labels: the job folder name and the rank/node of the container.
DOCKER_JOB_LABEL = "dev.stoker.job"
# Cloud instance tag (AWS EC2 and compatible APIs); value "true".
CLOUD_OWNER_TAG = "stoker:owned"
# Prefect flow run tag (deployments of Stoker flows set it; flow runs inherit deployment tags).
PREFECT_OWNER_TAG = "stoker:owned"
