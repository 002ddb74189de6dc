"""The memory knobs of one training: the micro-batch the ``auto`` finder picks and the estimate
(:mod:`.autobatch`), activation checkpointing (:mod:`.checkpointing`), activation offloading
(:mod:`.activation_offloading`) and a CPU run's allocator (:mod:`.host_allocator`)."""
