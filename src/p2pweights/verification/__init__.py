"""The trainer side of verified writes, in one place: whether each engine's writes are
checked and how (the policy), what the sender hashes, the comparisons, and what a failed
check leaves the engines in.

- ``check``: the policy (``WriteCheck.connect`` / ``for_config``: write digests where an
  engine records them, else sglang's ``/weights_checker``, else unverified or refused),
  the write digests' comparison after ``end_weight_update``, and ``verified_by``;
- ``records``: an engine rank's write-digest record, carried by its end's answer or read
  from the engine: whether it belongs to this update, and what it holds;
- ``staged``: the sender's write digests of every staged slot and direct load, and the
  digests of parameters several owners write, summed from their shares;
- ``checker`` and ``checksums``: sglang's ``/weights_checker`` check before
  ``end_weight_update`` (each engine's checker asked once among the sending ranks), and
  the sender's hashes for it (sglang's own function);
- ``update_checks``: one update's checks on one trainer rank, in the collective steps
  ``update_attempt`` places them in, and what their outcome leaves the engines in.

What both sides compute or speak lives below both, in ``wire``: the digest's definition
and its kernel (``wire/digest.py``, ``wire/lanes_kernel.py``), the landed flags
(``wire/landed.py``), the digest record's envelope and the end answer's records
(``wire/publication.py``). What must run in the engine lives on the engine side
(``engine_rank``: the record taken before the end, the digests taken as writes land),
called by the p2pweights sglang plugin's hooks and the local engine. The HTTP calls that
fetch records and checksums are ``engines/client.py``'s. docs/reliability.md ("Verified
writes")."""
