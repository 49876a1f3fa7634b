"""Training objectives. Labels are next-token targets aligned with the logits (labels[t] is the
token after position t), IGNORE where a position has no target (prompt tokens, padding)."""

import torch.nn.functional as F

IGNORE = -100


def distill_loss(student_logits, teacher_logits, labels, alpha: float = 1.0, beta: float = 0.1):
    """"The Mamba in the Llama" eq. 2: alpha * NLL of the pseudo-label tokens plus beta * the word-level
    KL(teacher || student) of the next-token distributions at the same positions, each averaged over
    the labelled positions (the paper sums over t; the mean keeps the scale independent of length).
    Returns (loss, {"nll": ..., "kl": ...})."""
    mask = labels != IGNORE
    logp = F.log_softmax(student_logits[mask].float(), dim=-1)  # only labelled rows: vocab-sized rows are big
    logq = F.log_softmax(teacher_logits[mask].float(), dim=-1)
    nll = -logp.gather(-1, labels[mask][:, None]).mean()
    kl = (logq.exp() * (logq - logp)).sum(-1).mean()
    return alpha * nll + beta * kl, {"nll": nll.detach(), "kl": kl.detach()}


def nll_loss(logits, labels):
    """Cross-entropy of the labelled tokens (SFT)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE)


def sequence_logprob(logits, labels):
    """Sum over each sequence's labelled tokens of log p(token): (batch,)."""
    mask = labels != IGNORE
    logp = F.log_softmax(logits.float(), dim=-1).gather(-1, labels.clamp_min(0)[..., None])[..., 0]
    return (logp * mask).sum(-1)


def dpo_loss(chosen, rejected, ref_chosen, ref_rejected, beta: float = 0.1):
    """DPO ("The Mamba in the Llama" eq. 4) with the teacher as reference: the sequence log-probs of the
    preferred and dispreferred responses under student (chosen, rejected) and teacher (ref_*).
    Returns (loss, {"accuracy": share of pairs the student ranks right relative to the reference})."""
    margin = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
    return -F.logsigmoid(margin).mean(), {"accuracy": (margin > 0).float().mean().detach()}


def medusa_loss(head_logits, head_targets, decay: float = 0.8):
    """Medusa-1 (eq. 1): sum over heads k = 1..K of decay^k times head k's cross-entropy on the token
    k+1 places ahead, each averaged over its positions (the paper's lambda_k = 0.8^k; the reference
    code counts heads from 0, i.e. weights 1, 0.8, ...). head_logits[k-1]: (n_k, vocab), head_targets[k-1]: (n_k,).
    Returns (loss, {"head1": CE_1, ...})."""
    ces = [F.cross_entropy(x.float(), y) for x, y in zip(head_logits, head_targets)]
    loss = sum(decay**k * ce for k, ce in enumerate(ces, 1))
    return loss, {f"head{k}": ce.detach() for k, ce in enumerate(ces, 1)}


def kd_loss(step_logits, base_logits, decay: float = 1.0):
    """Distillation of tokens ahead: the sum over steps j of decay^j times the KL(p_base || p_step)
    between the base model's distribution at that position and step j's (a drafted step or a Medusa
    head), each averaged over its positions. With decay 1 this is ReDrafter's eq. 1 (the KL of the
    next-T-token distributions factorizes so); Medusa's heads take their weights 0.8^k.
    step_logits[j-1], base_logits[j-1]: (n_j, vocab). Returns (loss, {"kl1": ..., "top1_1": ...})."""
    parts, loss = {}, 0.0
    for j, (x, q) in enumerate(zip(step_logits, base_logits), 1):
        logp, logq = F.log_softmax(x.float(), -1), F.log_softmax(q.float(), -1)
        kl = (logq.exp() * (logq - logp)).sum(-1).mean()
        loss = loss + decay**j * kl
        parts[f"kl{j}"] = kl.detach()
        parts[f"top1_{j}"] = (x.argmax(-1) == q.argmax(-1)).float().mean().detach()
    return loss, parts
