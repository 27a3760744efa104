"""Front ends for other training loops: ``hf_trainer`` (``FuyouTrainer`` for Hugging Face ``Trainer``)."""
