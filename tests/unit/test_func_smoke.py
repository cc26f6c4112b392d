import torch

import pgs.func as pf


def test_readme_example_runs_and_moves_params():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    params = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt = pf.chain(
        pf.clip_by_global_norm(1.0),
        pf.scale_by_adam(b1=0.9, b2=0.95, eps=1e-8, mu_dtype=torch.float32, nu_dtype=torch.float32),
        pf.add_decayed_weights(0.1, mask=lambda path, p: p.ndim >= 2),
        pf.scale_by_learning_rate(pf.cosine_schedule(peak=3e-4, warmup=0, total=100)),
    )
    state = opt.init(params)
    grads = {k: torch.randn_like(p) for k, p in params.items()}
    updates, state = opt.update(grads, state, params)
    new = pf.apply_updates(params, updates)
    assert all(not torch.equal(new[k], params[k]) for k in params)
