"""Training the demo model's joint schema head (``clef-local train-head``, docs/demo-model.md).

``train_head`` is the command line; ``state_path_train`` the recipe that trained the shipped head (a state-path head,
``state_path``, on a frozen backbone's cached outputs, ``hidden_cache``), with its settings in ``config``, its data in
``demo_data``, ``records`` and ``questions``, its losses in ``head_losses``, its loop's pieces in ``loop`` and its
metrics and calibration in ``validation``. ``adapter_train`` (with ``lora`` and ``decision_data``) trains LoRA
adapters on the backbone together with a whole-record head: Clef's own recipe, for a GPU."""
