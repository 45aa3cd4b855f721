"""A script that assumes its world size, as a Fabric script with devices=2 does (Lightning's own words)."""
import os

world_size = int(os.environ["WORLD_SIZE"])
if world_size != 2:
    raise ValueError(f"You set `devices=2` and `num_nodes=1` in Lightning, but the product (2 * 1) does not match "
                     f"the world size ({world_size}).")
