-- Run by the postgres image on first start (empty data folder): MLflow's own database.
CREATE DATABASE mlflow OWNER stoker;
