"""Proposers: whatever drafts a round's tokens, side by side.

* :mod:`.base` - the protocol the decoding loop calls (``Round`` in,
  ``Proposal`` out) and what proposers share;
* :mod:`.dspark` - DSpark and DFlash drafters (:mod:`.dspark_config`,
  :mod:`.dspark_heads`: the sequential and confidence heads);
* :mod:`.eagle3` - EAGLE-3 drafters (:mod:`.eagle3_config`);
* :mod:`.mtp` - MTP modules of Qwen3-Next / Qwen3.5 checkpoints
  (:mod:`.mtp_config`); :mod:`.chain` - the chain drafting both share;
* :mod:`.gemma4_assistant` - Gemma-4 assistant drafters
  (:mod:`.gemma4_assistant_config`);
* :mod:`.copying` - copies from the context and the phrase store, composed
  with a drafter; the pair's proposer;
* :mod:`.suffix` - suffix drafts, with no drafter or beside one, from
  :mod:`.suffix_store` (the request's index and the global store) and
  :mod:`.suffix_files` (the store's place on disk);
* :mod:`.vocabulary` - a reduced draft vocabulary and its map to the target's.
"""
