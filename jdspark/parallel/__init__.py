"""Several devices: one `jax.sharding.Mesh` with a `tensor` and an `expert` axis (`mesh`), the
partition rule of every parameter (`rules`), placing a model on a mesh (`shard`) and the
multi-process start (`distributed`). The package imports nothing from `jdspark.model` at this
level, so the model can import `mesh` and `rules` without a cycle."""
