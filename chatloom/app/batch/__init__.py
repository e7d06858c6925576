"""The Batch API's runner: a batch's input file read into request lines, each line run through the one
generation pipeline in the batch traffic class (below every interactive tier, at the quota discount), its
progress kept per line in the database under a lease another gateway takes over, and the output and error
files written when it ends. Which request format a line is in (chat completions, completions...) is the
API room's business: it hands the runner one `Endpoint` per URL."""
