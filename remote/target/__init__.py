"""The target model: loading and hidden-state capture (``model``), the KV cache and its rollback
(``cache``), the pre-flight memory plan (``memory``, no torch) and the demo's tiny tokenizer
(``tokenizer``)."""
