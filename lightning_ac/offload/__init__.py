"""Moving tensors between the device and host memory: activation offloading and layer (weight) offloading."""

from lightning_ac.offload.activations import ActivationOffloadRuntime
from lightning_ac.offload.device import DeviceStreams, HostMemoryError, available_host_bytes
from lightning_ac.offload.engine import OffloadStats, Packed, TransferEngine
from lightning_ac.offload.weights import LayerWeightStreamer

__all__ = [
    "ActivationOffloadRuntime",
    "DeviceStreams",
    "HostMemoryError",
    "LayerWeightStreamer",
    "OffloadStats",
    "Packed",
    "TransferEngine",
    "available_host_bytes",
]
