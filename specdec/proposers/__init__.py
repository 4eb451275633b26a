"""Proposers guess the next K tokens of each sequence (vLLM's `spec_decode` proposers)."""
from specdec.proposers.base import Proposer
from specdec.proposers.draft_model import DraftModelProposer
from specdec.proposers.ngram import NgramProposer, lookup_proposer

__all__ = ["Proposer", "DraftModelProposer", "NgramProposer"]
