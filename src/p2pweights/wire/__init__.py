"""What crosses between the trainer side and the engine side: pure data and codecs.

Both sides speak these formats, so they live below both: what an engine rank publishes
(``publication``: addresses, lengths, epochs, transports, the digest record's role), the
delta payload's wire format (``delta``), the write digest's definition (``digest``, with
its kernel ``lanes_kernel``), and the texts of sglang's answers that p2pweights matches
on (``sglang_texts``). Nothing here does I/O, imports sglang or a transport, or imports
any other part of p2pweights but ``errors``, ``environment`` and ``bounded_cache``.
"""
