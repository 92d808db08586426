from tests.actors.workers.conftest import ray_cluster, tiny_model_dir  # noqa: F401  (shared session fixtures)
