"""Moving the trainer's weights into a rollout server: one `WeightRoute` per way (disk.py,
shared.py, nccl.py), which one a run takes (route.py), and the `WeightSyncer` that sends through
it with disk as the fallback (syncer.py); the weights themselves in policy.py."""
