package wire

import (
	"bytes"
	"encoding/json"
	"errors"
)

// DecodeGeneric is Decode as it was before it read the text itself: the
// whole value parsed into encoding/json's generic form, then assigned. The
// tests hold Decode to the same answers.
func DecodeGeneric(data []byte, v any) error {
	depth, err := Nesting(data)
	var trailing *TrailingDataError
	switch {
	case errors.As(err, &trailing):
		return &FieldError{Problem: "has data after the JSON value"}
	case err != nil:
		return &FieldError{Problem: "is not valid JSON: " + err.Error()}
	case depth > MaxDepth:
		return &FieldError{Problem: "is nested too deep"}
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	var generic any
	if err := dec.Decode(&generic); err != nil {
		return &FieldError{Problem: "is not valid JSON: " + err.Error()}
	}
	return DecodeValue(generic, v)
}
