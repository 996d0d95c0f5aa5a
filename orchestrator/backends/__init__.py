"""Ways to run a shard besides an SSH host's detached worker (each an optional extra).

- ray.py: a Ray cluster (inventory ``kind: ray``): one detached actor per shard, holding its GPUs
"""
