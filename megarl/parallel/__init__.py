"""Parallel plumbing: the layout type and its rule (:mod:`.layout`), process-group and Megatron
``parallel_state`` start-up (:mod:`.init`), CPU emulation of CUDA calls (:mod:`.emulation`), the
local world launcher for commands run without torchrun (:mod:`.spawn`), the all-gather the
DP/TP gathers share (:mod:`.collectives`) and the import hooks that keep every process's start
short (:mod:`.import_hooks`)."""
