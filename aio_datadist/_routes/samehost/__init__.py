"""The same-host routes: this engine's caches published on a region board (``provider``),
and one-sided copies with a peer the kernel proved a process of this host (``memory``,
``route``): ``process_vm_readv``/``writev``, memcpy through its shared arenas, or its
shared device memory."""
