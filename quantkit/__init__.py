"""quantkit: FP16 -> calibrated INT4/INT8 checkpoints -> served, with the accuracy delta measured."""

__version__ = "0.1.0"
