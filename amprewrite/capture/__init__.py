"""From a model to a GraphModule whose weights are ``get_attr`` nodes: the symbolic tracer
(``symbolic``), ``torch.export`` in the AMP regime (``export``), a module already converted
(``converted``), the keywords of a forward's ``**kwargs`` named for torch.export's dynamic
shapes (``keywords``), torch.export's input-shape check without its per-call Dynamo patch
(``guards``), what a capture read of the model and the check that it still holds (``reads``,
``snapshot``), the facts capture leaves on nodes for the passes (``facts``), user-defined
autograd Functions found in a graph (``custom_functions``), LayerDrop decided while tracing
(``layerdrop``), the buffers a captured module saves (``persistence``), the global torch
state a conversion must leave as it found it (``state``), where eager ``nn.MultiheadAttention``
would take its fused path (``attention``), and torch's own log records of a capture kept out of
the terminal (``logs``). For the compile route: activation checkpoints in Dynamo graphs
(``checkpoints``), what the Python between Dynamo's graphs runs under (``graph_breaks``) and
library ops with their own autocast kernel (``own_autocast``). What a converted module does after
``convert`` is :mod:`amprewrite.module`'s."""
