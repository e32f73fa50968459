"""The Lightning faces of the suite: thin callbacks that turn their arguments into typed requests
(:mod:`lightning_ac.config`) and share one :class:`~lightning_ac.plan.Plan` per Trainer run.

- :mod:`~lightning_ac.callbacks.base`: :class:`SuiteCallback`, the shared plan's life in a run;
- :mod:`~lightning_ac.callbacks.checkpointing`: :class:`ActivationCheckpointing`;
- :mod:`~lightning_ac.callbacks.activation_offload`: :class:`ActivationOffload`;
- :mod:`~lightning_ac.callbacks.layer_offload`: :class:`LayerOffload`;
- :mod:`~lightning_ac.callbacks.factory`: :func:`callbacks_from_config`, the callbacks a block asks for.
"""

from lightning_ac.callbacks.activation_offload import ActivationOffload
from lightning_ac.callbacks.base import SuiteCallback
from lightning_ac.callbacks.checkpointing import ActivationCheckpointing
from lightning_ac.callbacks.factory import callbacks_from_config
from lightning_ac.callbacks.layer_offload import LayerOffload

__all__ = ["ActivationCheckpointing", "ActivationOffload", "LayerOffload", "SuiteCallback", "callbacks_from_config"]
