"""Speech to text: Whisper (an encoder over log-mel features, a decoder that writes the text), the
features it reads, and audio decoding."""
