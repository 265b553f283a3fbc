"""Registers the baselines' pure ops."""

from baselines.dense import dense
from models.ops_registry import OpSpec, register

register(OpSpec("dense", dense, description="exact softmax attention, O(L^2)"))
