"""Training a DSpark drafter, along its seams (:mod:`.run` is what ``mlx_dspark.train`` runs).

* :mod:`.run` - a training run from its arguments: data, store, steps, export;
* :mod:`.data` - training text: reading, tokenizing, regenerating with the target;
* :mod:`.model` - the drafter's configuration and initialisation, and the
  many-blocks-at-once training forward;
* :mod:`.batches` - anchors, blocks and labels of a step, the draft vocabulary;
* :mod:`.teacher` - the target's features and distributions: a store computed
  once and memory-mapped, or computed on the fly;
* :mod:`.loss` - the DSpark loss (CE + total variation + confidence BCE);
* :mod:`.trainer` - the optimisation loop;
* :mod:`.checkpoint` - exact-resume checkpoints and the DeepSpec-format export.
"""
