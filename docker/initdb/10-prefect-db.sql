-- The Prefect server keeps its state in its own database beside MLflow's.
CREATE DATABASE prefect OWNER peagle;
