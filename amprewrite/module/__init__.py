"""The converted module after ``convert``: one guarded cache of graphs (``cache``) and what
its graphs share (``sharing``), the train and eval modes (``modes``), how it is called
(``calling``), the placeholder of a module captured at its first call (``first_call``), the
model's attributes and methods on it (``model_view``), the model's other methods and the
submodules its code hands out, converted at their first call (``methods``), its submodules, which are the model's
own (``tree``), its watch over the model's tensors and hooks (``model_watch``), and captures
alone and outside the caller's modes (``isolation``)."""
