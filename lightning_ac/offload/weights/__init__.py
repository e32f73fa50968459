"""Layer offloading: frozen decoder-layer parameters live in host memory and visit the device one layer at a time.

Each decoder layer's frozen parameters are copied once into one host buffer per layer (pinned on an accelerator), in
``Callback.setup``, before the strategy places the module: the strategy's ``module.to(device)`` skips them (a dtype
conversion converts their host copies), DDP's broadcast of the module's state leaves them to us, and the device
never holds them whole. Between uses a parameter's ``.data`` *is* its slice of that buffer, so ``state_dict``,
checkpoints and user code between steps see real values. Before a layer runs, its parameters are copied to the
device on a side stream, and the next layer's copy starts while this one computes; after it runs, ``.data`` points
at the host copy again and the device copy is freed. Backward walks the layers in reverse: when the gradient reaches
a layer's outputs (or the layer is called again to recompute it), that layer comes back, the one before it is
prefetched, and every other layer (those after it, whose backward is done, and the end of another forward's chain
when a step ran the layers more than once) goes. A callback queued on the autograd engine releases whatever is still
on the device when backward ends.

Autograd keeps what it saves of a parameter as a view of the parameter's device memory (``linear`` saves
``weight.t()``), which would keep every layer's weights on the device until backward. During a layer's call a
saved-tensor hook therefore keeps a reference to the parameter instead of such a view and rebuilds the view
from the reloaded copy when backward asks for it; other tensors go to the saved-tensor hooks already in force
(activation offloading's, or a checkpoint's around the layer).

The CPU may run ahead of the device; the allocator cannot reuse a released copy until the device has finished
with it (the copy is ``record_stream``'d to the compute stream), so the host waits for the device before each
new copy (as FSDP's ``limit_all_gathers`` does), to keep two layers on the device at most: in forward the next
layer is loaded once this one's kernels are issued, after the device has passed the release of the layer
before; in backward the layer before is loaded once the device has passed the release of the layer after.

On a CPU device the same path runs synchronously with separate host tensors standing in for device copies
(``copy_on_host``); the accelerator branch runs on the CPU on the simulated asynchronous device
(:mod:`lightning_ac.testing.simulated`).

The package: :mod:`.slots` (what moves), :mod:`.host` (host buffers), :mod:`.residency` (loading and releasing a
layer), :mod:`.streamer` (when: the forward hooks), :mod:`.saved` (saved-tensor hooks), :mod:`.four_bit`
(bitsandbytes' kept weight), :mod:`.conversions` (module conversions).
"""

from lightning_ac.offload.weights.slots import frozen_layer_parameters
from lightning_ac.offload.weights.streamer import LayerWeightStreamer

__all__ = ["LayerWeightStreamer", "frozen_layer_parameters"]
