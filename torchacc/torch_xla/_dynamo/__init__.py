"""``torch_xla._dynamo`` on torchacc: the bridge torch's ``"openxla"`` dynamo backend calls."""
