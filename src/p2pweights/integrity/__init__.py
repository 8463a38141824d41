"""The trainer side of verified writes, in one place: whether each engine's writes are
checked and how (the policy), what the sender hashes, and the comparison.

- ``check``: the policy (``WriteCheck.connect``: write digests where an engine records
  them, else sglang's ``/weights_checker``, else unverified or refused) and the write
  digests' comparison after ``end_weight_update``;
- ``staged``: the sender's write digests of every staged slot and direct load;
- ``checker`` and ``checksums``: sglang's ``/weights_checker`` check before
  ``end_weight_update``, and the sender's hashes for it (sglang's own function).

What both sides compute lives below both, in ``wire`` (the digest's definition and its
kernel, ``wire/digest.py``; the landed flags, ``wire/landed.py``); what must run in the
engine lives on the engine side (``engine_rank``: the record taken before the end, and
the digests taken as writes land). docs/reliability.md ("Verified writes")."""
