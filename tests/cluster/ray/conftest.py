from tests.actors.workers.conftest import tiny_model_dir  # noqa: F401  (shared session fixture; ray_cluster is in tests/conftest.py)
