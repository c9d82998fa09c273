"""From a model to a GraphModule whose weights are ``get_attr`` nodes: the symbolic tracer
(``symbolic``), ``torch.export`` in the AMP regime (``export``), a module already converted
(``converted``), torch.export's input-shape check without its per-call Dynamo patch
(``guards``), what a capture read of the model and the check that it still holds (``reads``,
``snapshot``), the facts capture leaves on nodes for the passes (``facts``), user-defined
autograd Functions found in a graph (``custom_functions``), LayerDrop decided while tracing
(``layerdrop``), the buffers a captured module saves (``persistence``), and the global torch
state a conversion must leave as it found it (``state``). What a converted module does after
``convert`` is :mod:`amprewrite.module`'s."""
