"""The PyTorch backend: `torch.autograd.grad` and an eager probe
(`autodiff`); row kernels in place or as `autograd.Function`s where eager
torch would make more passes, and torch's own calls on a composite's
state, where a Keras call costs Python time at every step (`kernels`); the
chunk loops as `autograd.Function`s (`chunks`); the processes of
`torch.distributed` as replicas under DDP (`distribution`; Keras itself
has no torch distribution)."""
