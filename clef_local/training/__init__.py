"""Training the demo model's joint schema head (``clef-local train-head``, docs/demo-model.md): ``train_head`` is the
command line, ``state_path_train`` the shipped head's recipe (on ``hidden_cache``'s cached outputs, with ``config``,
``demo_data``, ``records``, ``questions``, ``head_losses``, ``loop``, ``validation``); ``adapter_train`` (with
``lora`` and ``decision_data``) trains LoRA adapters with a whole-record head, Clef's own recipe, for a GPU."""
