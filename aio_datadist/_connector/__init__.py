"""What a serving engine's KV connector needs, engine-neutral: one node per worker.

A :class:`~aio_datadist._connector.node.KvNode` holds one ``AsyncLLMDataDist`` on an event
loop of its own thread, the worker's KV cache registered in place, a control channel to and
from peer nodes, the prefill side's block leases and pushes (``producer``) and the decode
side's loads (``consumer``). ``aio_datadist.vllm`` adapts it to vLLM's connector API; nothing
here imports vLLM or torch.
"""
