"""Code the test modules share (tests/ is on pytest's pythonpath, so `from helpers.X import Y`
works in tests/ and tests/gpu/ alike): run directories and `grail_train` (run_dirs), stand-ins
for the built-in server (fake_server) and for vLLM/SGLang (fake_gpu_server), and the checks run
in the real vLLM's or SGLang's interpreter (real_packages, backend_argv_check,
weight_transfer_check). Plugin files that runs load by name (tests/reward_plugins.py,
tests/cli_plugins.py) stay in tests/, where their names point."""
