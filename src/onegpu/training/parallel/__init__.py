"""More than one process: data parallelism over ``train.num_processes`` (:mod:`.distributed`), FSDP2
sharding (:mod:`.sharding`) and launches over ``train.num_machines`` (:mod:`.machines`). Nothing here knows
an objective or a backend."""
