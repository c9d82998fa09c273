"""Facts about FX nodes that every later stage shares: the decision and cast records under one
meta key (``meta``), re-running a node on fake tensors (``fake``), pure-cast and in-place
queries (``queries``), the generated code that calls torch's bindings (``codegen``, the
bindings proven to run each op in ``bindings``, its layout in ``layout`` and ``wrapping``) ,
the inputs a converted module was captured for (``inputs``), composite ops one level at a time
(``composites``) and nodes moved between a graph and the sub-graphs of its higher-order ops
(``subgraphs``)."""
