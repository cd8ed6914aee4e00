"""Request and response models: TGI's (tgi.py), the model control API's (models.py) and the
OpenAI chat API's (chat.py)."""
