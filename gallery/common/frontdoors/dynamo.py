"""The whole-step front door (``--compiler-opt --compile_mode=dynamo``): tensors stay on the eager
device and ``torchacc.dynamo.compile_step`` turns the step (preprocess, forward, loss, backward,
gradient all-reduce, GradScaler, optimizer update) into one program."""

from __future__ import annotations

from gallery.common.frontdoors.eager import Eager

__all__ = ["Dynamo", "forward"]


def forward(model, inputs):
    """``model(inputs)``, or ``model(*inputs)`` for a tuple of input tensors."""
    return model(*inputs) if isinstance(inputs, tuple) else model(inputs)


class Dynamo(Eager):
    dynamo = True

    def place(self, model, task):
        model = super().place(model, task)
        self.mode = "torchacc-dynamo"
        return model

    def wrap(self, model):
        return model  # the compiled step all-reduces the gradients itself

    def compile_counter(self):
        from torchacc import metrics

        return lambda: metrics.counter_value("StepTrace") or 0

    def compiled_step(self, task, model, optimizer, scaler, autocast_cm):
        """The step through ``compile_step``: its first call runs eagerly, the second traces and
        compiles, later ones launch the program. The LR stays a runtime input; the all-reduce
        is the recipe's ``xm.all_reduce``, compiled into the step."""
        from torchacc.dynamo import compile_step

        world_size = self.world_size
        xm = None
        if world_size > 1:
            import torchacc.torch_xla.core.xla_model as xm

        def train_step(inputs, target):
            if task.preprocess is not None:
                inputs = task.preprocess(inputs)
            with autocast_cm():
                loss = task.loss_fn(forward(model, inputs), target)
            optimizer.zero_grad(set_to_none=True)
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if xm is not None:
                xm.all_reduce("sum", xm._fetch_gradients(optimizer), scale=1.0 / world_size)
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            return loss.detach()

        scalers = [scaler] if scaler is not None else []
        return compile_step(train_step, models=[model], optimizers=[optimizer], scalers=scalers)
