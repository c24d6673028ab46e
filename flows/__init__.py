"""Prefect flows and deployments: the only place that imports prefect."""
