"""The names verl 0.7's legacy ParallelLlama modules import; none may run."""

from flash_attn import missing

index_first_axis = missing("bert_padding.index_first_axis")
pad_input = missing("bert_padding.pad_input")
unpad_input = missing("bert_padding.unpad_input")
