"""What every engine rank does around its update session, whatever engine runs it.

The sglang plugin and the local engine both build on it: ``steps`` (the rank's record
and its before-end steps: apply a pending delta, then digest the parameters),
``delta_scratch`` (the scratch region a rank publishes for delta payloads) and
``delta_apply`` (decoding a payload into the parameters). It imports ``wire`` and the
ground (``config``, ``errors``, ``environment``), never the trainer side.
"""
