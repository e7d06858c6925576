"""The Responses API's own behaviour (/v1/responses): input items as chat turns, the output items and
semantic stream events a run becomes, and stored responses (their items in the database, so that
`previous_response_id` continues a thread on any gateway). The route in api/routes/responses.py only
translates HTTP; every generation still goes through generation/pipeline.py."""
