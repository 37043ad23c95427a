"""FedKTL: Zhang et al., "An Upload-Efficient Scheme for Transferring Knowledge From a Server-Side Pre-trained
Generator to Clients in Heterogeneous Federated Learning", CVPR 2024."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Annotated

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..client.context import ClientContext
from ..client.joint import fit_jointly
from ..client.steps import vmappable
from ..federation.bounds import Ge, NonNegative, Positive, PositiveInt
from ..federation.errors import ConfigError
from ..federation.types import ClientSpec, ClientTask, ClientUpdate, ModelWeights, StateDict, TensorPayload, clone_state
from ..knowledge.class_stats import ClassStatistics, ClassStatsCollector
from ..knowledge.latent_alignment import alignment_loss, arcface_loss, feature_transformer, simplex_etf
from .base import PersonalModels, ServerContext, Split, Strategy

CLIP_NORM = 100.0  # the FedKTL code clips the server's F and centroids at this gradient norm


@dataclass
class FedKTLState:
    """What FedKTL's server keeps between rounds."""

    etf: Tensor  # [C, C] the fixed class vectors (rows, unit length)
    projection: StateDict  # the fixed initial Linear(D, L) each client trains from in every round
    transformer: nn.Sequential  # F: the clients' C-dimensional prototypes to the generator's latent space
    centroids: nn.Embedding  # [C, L] each class's latent centroid
    latents: Tensor  # [C, L] the latents of the last generated images (empty before the first aggregation)
    images: Tensor  # [C, ...] one generated image per class (empty before the first aggregation)


class FedKTL(PersonalModels, Strategy):
    """Personal heterogeneous models classifying against a fixed simplex ETF, with knowledge from a server-side
    image generator, a model role the recipe supplies (``generator_role``).

    Client k keeps its own model, whose head has C outputs. It trains on the ArcFace loss of its outputs against
    the ETF's class vectors (margin ``margin``, scale ``scale``) plus, once generated images exist,
    ``mu * MSE(h(features(x~)), z~)`` on the server's (image, latent) pairs, ``h`` a linear projection to the
    generator's latent space that starts from the server's fixed initial weights every round and trains with the
    model. It uploads, per class it holds, the normalised mean of its normalised outputs over its training data
    (eval mode): ``S x (C + 1)`` numbers. The server maps the round's uploads into the latent space with ``F``
    (Linear + BatchNorm + ReLU + Linear) and trains ``F`` and per-class centroids on
    ``MMD(F(P), w) + lam * MSE(F(P), centroid_y)`` (``w`` latents of the generator's random noise), then
    generates one image per class from its centroid. Down go the ETF (``C x C``), the projection
    (``D x L + L``) and, from round 2, the C images with their latents. Every client model needs the same
    feature size D and C outputs.

    Evaluation: each client's model by the nearest class vector (cosine), run as its head followed by the ETF.
    What the generator must be, and what a random one can show: ``docs/algorithms.md``, FedKTL.

    Args:
        generator_role: the ``models`` entry of the generator (a ``LatentGenerator``; no tier lists it).
        mu: weight of the clients' latent term (50 in the official StyleGAN scripts, 100 with Stable Diffusion).
        lam: weight of the server's centroid term (1 in the official StyleGAN-XL scripts).
        margin, scale: ArcFace's m and s (0.5 and 64 in the code).
        server_lr: the server's Adam learning rate (0.01).
        server_epochs: passes of the server over a round's uploads (100).
        server_batch_size: uploads per server step (100).
        split: where personal models are evaluated: ``test`` (each client's local test split, as HtFLlib) or
            ``global`` (the global test set).
    """

    needs_split = True  # trains the features apart (the latent term) and swaps the head for evaluation

    state: FedKTLState

    def __init__(
        self,
        generator_role: str = "generator",
        mu: NonNegative = 50.0,
        lam: NonNegative = 1.0,
        margin: NonNegative = 0.5,
        scale: Positive = 64.0,
        server_lr: Positive = 0.01,
        server_epochs: PositiveInt = 100,
        server_batch_size: Annotated[int, Ge(2)] = 100,  # F's batch norm needs two rows
        split: Split = "test",
    ):
        self.generator_role, self.mu, self.lam, self.margin, self.scale = generator_role, mu, lam, margin, scale
        self.server_lr, self.server_epochs, self.server_batch_size = server_lr, server_epochs, server_batch_size
        self.split: Split = split

    def server_roles(self) -> tuple[str, ...]:
        return (self.generator_role,)

    def setup(self, server: ServerContext) -> None:
        super().setup(server)
        server.require_one_role_per_client()
        server.require_server_only_role(self.generator_role)
        self.num_classes = c = server.data.num_classes
        self.client_roles = sorted({client.roles[0] for client in server.clients})
        self.feature_dim = self._check_client_models(server)
        self.noise_dim, self.latent_dim = self._check_generator(server)
        device = server.data.x.device
        projection = nn.Linear(self.feature_dim, self.latent_dim)  # drawn at setup, as the code's server does
        self.state = FedKTLState(
            simplex_etf(c).to(device),
            clone_state(projection.to(device).state_dict()),
            feature_transformer(c, self.latent_dim).to(device),
            nn.Embedding(c, self.latent_dim).to(device),
            torch.empty(0, device=device),
            torch.empty(0, device=device),
        )

    def _check_client_models(self, server: ServerContext) -> int:
        """The common feature size D of the clients' models, whose heads must be ``nn.Linear(D, C)``."""
        heads = {r: server.model(r).head for r in self.client_roles}
        shapes = {r: (h.in_features, h.out_features) if isinstance(h, nn.Linear) else None for r, h in heads.items()}
        shape = next(iter(shapes.values()))
        if shape is None or len(set(shapes.values())) != 1 or shape[1] != self.num_classes:
            raise ConfigError(
                f"FedKTL classifies every client's {self.num_classes} outputs against one ETF and projects every "
                f"client's features with one layer, so every client role's head must be nn.Linear(D, "
                f"{self.num_classes}) with the same D; got (in, out) {shapes}."
            )
        return shape[0]

    def _check_generator(self, server: ServerContext) -> tuple[int, int]:
        """The generator's noise and latent sizes, after one probe that its images have the data's shape."""
        role, model = self.generator_role, server.model(self.generator_role)
        noise_dim = getattr(model, "noise_dim", None)
        if not isinstance(noise_dim, int):
            raise ConfigError(
                f"FedKTL's generator role {role!r} must be a LatentGenerator (features: noise to latents, head: "
                f"latents to images, noise_dim); its builder returned a {type(model).__name__} without noise_dim. "
                "Wrap the pretrained generator so (docs/algorithms.md, FedKTL) or use random_image_generator."
            )
        noise = torch.randn(2, noise_dim, generator=torch.Generator().manual_seed(0)).to(server.data.x.device)
        latents = server.features(role, None, noise)
        images = server.head_outputs(role, None, latents)
        expected = tuple(server.data.x.shape[1:])
        if latents.dim() != 2 or tuple(images.shape[1:]) != expected:
            raise ConfigError(
                f"FedKTL's generator role {role!r} gives latents {list(latents.shape[1:])} and images "
                f"{list(images.shape[1:])}, but the clients' examples are {list(expected)}; its head must produce "
                "images of the data's shape (e.g. image_size and in_channels of random_image_generator)."
            )
        return noise_dim, latents.shape[1]

    # ------------------------------------------------------------------ server -> client
    def configure_round(self, rnd: int, clients: list[ClientSpec]) -> list[ClientTask]:
        state = self.state
        # both fixed; sent every round as the code reloads them (docs/algorithms.md, FedKTL: traffic)
        downlink = {
            "etf": TensorPayload("etf", {"etf": state.etf}),
            "projection": ModelWeights("projection", state.projection),
        }
        if len(state.images):
            downlink["generated"] = TensorPayload("generated", {"images": state.images, "latents": state.latents})
        return [ClientTask(c, rnd, dict(downlink)) for c in clients]

    # ------------------------------------------------------------------ client
    def client_update(self, task: ClientTask, ctx: ClientContext) -> ClientUpdate:
        role = task.client.roles[0]
        module = ctx.load(role, self.server.own_weights(task.client, ctx.state.get("weights")))
        etf = ctx.on_device("etf", task.received("etf", TensorPayload).tensors["etf"])
        margin, scale = self.margin, self.scale  # values, not the strategy, in the closure
        if "generated" not in task.downlink:  # round 1: no image yet

            @vmappable  # pure: batched clients, CUDA graphs
            def step(module, batch, i):
                x, y = batch
                return arcface_loss(module(x), y, etf, margin, scale)

            loss = ctx.fit(role, step_fn=step)["loss"]
        else:
            generated = task.received("generated", TensorPayload)
            projection = task.received("projection", ModelWeights).state
            loss = self.fit_with_generated(role, ctx, etf, generated, projection)
        ctx.state["weights"] = ctx.weights(role)
        upload = self.class_prototypes(module, ctx)
        return ClientUpdate(task.client, ctx.num_examples(), {"class_prototypes": upload}, {f"{role}/loss": loss})

    def fit_with_generated(
        self, role: str, ctx: ClientContext, etf: Tensor, generated: TensorPayload, projection: StateDict
    ) -> float:
        """ArcFace plus ``mu`` times the latent term, the model and the projection ``h`` trained together; ``h``
        starts from the server's weights (the code reloads it every round and keeps nothing of its training)."""
        images = ctx.on_device("images", generated.tensors["images"])
        latents = ctx.on_device("latents", generated.tensors["latents"])
        projector = ctx.helper("ktl_projection", nn.Linear(self.feature_dim, self.latent_dim), projection)
        chunks = [c.to(images.device) for c in generated_chunks(len(images), ctx.batch_size, ctx.local_steps())]
        margin, scale, mu = self.margin, self.scale, self.mu

        def step(modules, batch, i):
            x, y = batch
            model, chosen = modules[role], chunks[i % len(chunks)]
            loss = arcface_loss(model(x), y, etf, margin, scale)
            projected = projector(model.features(images[chosen]))
            return {role: loss + mu * F.mse_loss(projected, latents[chosen])}

        return fit_jointly(ctx, [role], step, helpers=[projector])[role]

    @torch.no_grad()
    def class_prototypes(self, module, ctx: ClientContext) -> ClassStatistics:
        """Per class held, the normalised mean of the normalised eval-mode outputs over the training data:
        ``[S, C]`` (compact)."""
        module.eval()
        idx, size = ctx.indices.train, ctx.eval_batch_size
        collector = ClassStatsCollector(self.num_classes, {"prototypes": self.num_classes}, idx.device)
        for start in range(0, len(idx), size):
            chosen = idx[start : start + size]
            collector.add(ctx.data_y[chosen], prototypes=F.normalize(module(ctx.data_x[chosen]).float(), dim=1))
        upload = collector.result("class_prototypes").compact()
        upload.vectors["prototypes"] = F.normalize(upload.vectors["prototypes"], dim=1)
        return upload

    # ------------------------------------------------------------------ server
    def aggregate(self, rnd: int, updates: Iterator[ClientUpdate]) -> dict[str, float]:
        rows, labels = [], []
        for update in updates:
            upload = update.sent("class_prototypes", ClassStatistics)
            rows.append(upload.vectors["prototypes"].detach().float())
            labels.append(upload.labels.long())
        if not rows:
            return {}
        device = self.state.etf.device
        prototypes, classes = torch.cat(rows).to(device), torch.cat(labels).to(device)
        self.set_centroids(prototypes, classes)
        loss = self.train_alignment(prototypes, classes)
        self.set_centroids(prototypes, classes)
        self.state.latents = self.state.centroids.weight.detach().clone()
        self.state.images = self.server.head_outputs(self.generator_role, None, self.state.latents).float()
        return {"server/alignment_loss": loss}

    @torch.no_grad()
    def set_centroids(self, prototypes: Tensor, classes: Tensor) -> None:
        """Each uploaded class's centroid set to the mean of its transformed prototypes (``F`` in eval mode)."""
        transformer = self.state.transformer.eval()
        collector = ClassStatsCollector(self.num_classes, {"latents": self.latent_dim}, prototypes.device)
        collector.add(classes, latents=transformer(prototypes))
        present = collector.counts > 0
        weight = self.state.centroids.weight
        weight[present] = collector.result("latents").vectors["latents"][present].to(weight.dtype)

    def train_alignment(self, prototypes: Tensor, classes: Tensor) -> float:
        """``server_epochs`` passes of Adam on ``F`` and the centroids over the uploads in shuffled batches
        (a last batch of one left out, which batch norm cannot train on); the mean loss."""
        state, generator = self.state, self.server.round_generator()
        transformer, centroids = state.transformer.train(), state.centroids
        # one Adam over both: its update is per tensor, the code's two optimizers' exactly
        optimizer = torch.optim.Adam([*transformer.parameters(), *centroids.parameters()], lr=self.server_lr)
        total, steps = 0.0, 0
        for _ in range(self.server_epochs):
            order = torch.randperm(len(prototypes), generator=generator).to(prototypes.device)
            for batch in order.split(self.server_batch_size):
                if len(batch) < 2:
                    continue
                noise = torch.randn(len(batch), self.noise_dim, generator=generator).to(prototypes.device)
                latents = self.server.features(self.generator_role, None, noise).float()
                transformed = transformer(prototypes[batch])
                loss = alignment_loss(transformed, latents, centroids(classes[batch]), self.lam)
                optimizer.zero_grad()
                loss.backward()
                for module in (transformer, centroids):  # each clipped on its own, as the code
                    torch.nn.utils.clip_grad_norm_(module.parameters(), CLIP_NORM)
                optimizer.step()
                total, steps = total + loss.item(), steps + 1
        return total / max(steps, 1)

    # ------------------------------------------------------------------ evaluation
    def personal_weights(self, client: ClientSpec, state: dict) -> tuple[str, StateDict]:
        """The client's model with its head followed by the ETF (``W' = E W``, ``b' = E b``): the argmax of these
        logits is the class vector nearest in cosine to its outputs."""
        role, weights = super().personal_weights(client, state)
        etf = self.state.etf.to(weights["head.weight"].device)
        return role, {**weights, "head.weight": etf @ weights["head.weight"], "head.bias": etf @ weights["head.bias"]}


def generated_chunks(count: int, batch_size: int, steps: int) -> list[Tensor]:
    """The generated pairs each local step takes: all of them when they fit in a batch (the code's one batch of
    C); else consecutive ``batch_size`` chunks of a fresh permutation per pass, the last one partial (the
    code's shuffled loader without drop_last), drawn from torch's per-client-update generator."""
    if count <= batch_size:
        return [torch.arange(count)]
    chunks: list[Tensor] = []
    while len(chunks) < steps:
        chunks += list(torch.randperm(count).split(batch_size))
    return chunks[:steps]
